/* Fused byte-plane kernels for the chunk codecs (ckpt/codecs.py, ckpt/transforms.py).
 *
 * Each function is one pass over memory with the GIL released, where the numpy
 * versions take four to eight: the byte-plane split ("shuffle") and its inverse,
 * fused with the XOR delta and with the arithmetic delta (order-preserving
 * integers, subtracted with wraparound, zigzag). Layout of a plane-major buffer
 * for n elements of `elem` bytes: byte k of element i is at k*n + i.
 *
 * All arithmetic is on unsigned integers (wraparound is defined), so the result is
 * the same bit for bit as the numpy reference on every input; tests/ckpt/test_native.py
 * checks that on arbitrary bit patterns. The module is optional: ckpt falls back
 * to numpy when it is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ELEM 8

typedef enum { OP_PLAIN = 0, OP_XOR = 1, OP_SUB = 2, OP_GSUB = 3 } op_t;

/* OP_GSUB: OP_SUB with the elements reordered by a stable counting sort on the
 * KEY_BITS bits below the base element's sign (a float's exponent): how far a value
 * moves in units of its last place depends on its exponent, so grouping the deltas by
 * it gives zstd's per-block entropy tables runs of like-sized values. The decoder
 * recomputes the same order from the base it already has: no side information. */
#define KEY_BITS 10
#define NKEYS (1 << KEY_BITS)
/* the key: the KEY_BITS bits below the sign (a float's exponent and top mantissa bits) */
#define KEY(BITS, b) ((size_t)((b) >> ((BITS) - 1 - KEY_BITS)) & (NKEYS - 1))

/* order-preserving map of a float bit pattern (an involution): negative values
 * get their magnitude bits flipped. */
#define ORDERED(T, BITS, x) ((x) ^ (((T)0 - ((x) >> ((BITS) - 1))) & (((T)1 << ((BITS) - 1)) - 1)))
#define ZIGZAG(T, BITS, d) (((d) << 1) ^ ((T)0 - ((d) >> ((BITS) - 1))))
#define UNZIGZAG(T, z) (((z) >> 1) ^ ((T)0 - ((z) & 1)))

#define DEFINE_KERNELS(T, BITS)                                                            \
    static void encode_##BITS(const uint8_t *src, const uint8_t *base, uint8_t *dst,       \
                              Py_ssize_t n, op_t op) {                                     \
        const Py_ssize_t E = (BITS) / 8;                                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                               \
            T x, b = 0;                                                                    \
            memcpy(&x, src + i * E, sizeof(T));                                            \
            if (op != OP_PLAIN) memcpy(&b, base + i * E, sizeof(T));                       \
            if (op == OP_XOR) {                                                            \
                x ^= b;                                                                    \
            } else if (op == OP_SUB) {                                                     \
                T d = (T)(ORDERED(T, BITS, x) - ORDERED(T, BITS, b));                      \
                x = ZIGZAG(T, BITS, d);                                                    \
            }                                                                              \
            for (Py_ssize_t k = 0; k < E; k++) dst[k * n + i] = (uint8_t)(x >> (8 * k));  \
        }                                                                                  \
    }                                                                                      \
    static void decode_##BITS(uint8_t *const *planes, const uint8_t *base, uint8_t *dst,   \
                              Py_ssize_t n, op_t op) {                                     \
        const Py_ssize_t E = (BITS) / 8;                                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                               \
            T x = 0, b = 0;                                                                \
            for (Py_ssize_t k = 0; k < E; k++) x |= (T)planes[k][i] << (8 * k);            \
            if (op != OP_PLAIN) memcpy(&b, base + i * E, sizeof(T));                       \
            if (op == OP_XOR) {                                                            \
                x ^= b;                                                                    \
            } else if (op == OP_SUB) {                                                     \
                T o = (T)(UNZIGZAG(T, x) + ORDERED(T, BITS, b));                           \
                x = ORDERED(T, BITS, o);                                                   \
            }                                                                              \
            memcpy(dst + i * E, &x, sizeof(T));                                            \
        }                                                                                  \
    }


DEFINE_KERNELS(uint16_t, 16)
DEFINE_KERNELS(uint32_t, 32)
DEFINE_KERNELS(uint64_t, 64)

/* start[k]: first output position of key k (a stable counting sort's prefix sums).
 * The grouped kernels move whole elements (one scattered word per element, into as
 * many streams as there are distinct keys) and split/join the planes sequentially:
 * far cheaper than scattering each element's bytes into every plane. */
#define DEFINE_GROUPED(T, BITS)                                                            \
    static inline T load_##BITS(const uint8_t *p, Py_ssize_t i) {                          \
        T v; /* buffers may be unaligned: memcpy compiles to a plain load */               \
        memcpy(&v, p + i * (Py_ssize_t)sizeof(T), sizeof(T));                              \
        return v;                                                                          \
    }                                                                                      \
    static void group_starts_##BITS(const uint8_t *base, Py_ssize_t n, Py_ssize_t *start) { \
        /* four counter sets: runs of equal keys would otherwise serialise on one counter */ \
        uint32_t cnt[4][NKEYS];                                                            \
        memset(cnt, 0, sizeof(cnt));                                                       \
        Py_ssize_t i = 0;                                                                  \
        for (; i + 4 <= n; i += 4)                                                         \
            for (int l = 0; l < 4; l++) cnt[l][KEY(BITS, load_##BITS(base, i + l))]++; \
        for (; i < n; i++) cnt[0][KEY(BITS, load_##BITS(base, i))]++;         \
        Py_ssize_t pos = 0;                                                                \
        for (int k = 0; k < NKEYS; k++) {                                                  \
            start[k] = pos;                                                                \
            pos += (Py_ssize_t)cnt[0][k] + cnt[1][k] + cnt[2][k] + cnt[3][k];              \
        }                                                                                  \
    }                                                                                      \
    /* Encode: the differences in element order (a vectorisable pass, into dst as      \
     * scratch), then one scattered word per element into the sorted order, then the    \
     * plane split. Decode mirrors it: join, gather, undo the difference in place. */   \
    static void gencode_##BITS(const uint8_t *src, const uint8_t *base, uint8_t *dst,      \
                               Py_ssize_t n, uint8_t *tmpbuf, Py_ssize_t *start) {         \
        T *tmp = (T *)tmpbuf;                                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                               \
            T x = load_##BITS(src, i), bi = load_##BITS(base, i);                          \
            T d = (T)(ORDERED(T, BITS, x) - ORDERED(T, BITS, bi));                         \
            d = ZIGZAG(T, BITS, d);                                                        \
            memcpy(dst + i * (Py_ssize_t)sizeof(T), &d, sizeof(T));                        \
        }                                                                                  \
        group_starts_##BITS(base, n, start);                                               \
        for (Py_ssize_t i = 0; i < n; i++)                                                 \
            tmp[start[KEY(BITS, load_##BITS(base, i))]++] = load_##BITS(dst, i);           \
        encode_##BITS((const uint8_t *)tmp, NULL, dst, n, OP_PLAIN);                       \
    }                                                                                      \
    static void gdecode_##BITS(uint8_t *const *planes, const uint8_t *base, uint8_t *dst,  \
                               Py_ssize_t n, uint8_t *tmpbuf, Py_ssize_t *start) {         \
        T *tmp = (T *)tmpbuf;                                                              \
        decode_##BITS(planes, NULL, (uint8_t *)tmp, n, OP_PLAIN);                          \
        group_starts_##BITS(base, n, start);                                               \
        for (Py_ssize_t i = 0; i < n; i++) {                                               \
            T x = tmp[start[KEY(BITS, load_##BITS(base, i))]++];                           \
            memcpy(dst + i * (Py_ssize_t)sizeof(T), &x, sizeof(T));                        \
        }                                                                                  \
        for (Py_ssize_t i = 0; i < n; i++) {                                               \
            T z = load_##BITS(dst, i), bi = load_##BITS(base, i);                          \
            T o = (T)(UNZIGZAG(T, z) + ORDERED(T, BITS, bi));                              \
            o = ORDERED(T, BITS, o);                                                       \
            memcpy(dst + i * (Py_ssize_t)sizeof(T), &o, sizeof(T));                        \
        }                                                                                  \
    }

DEFINE_GROUPED(uint16_t, 16)
DEFINE_GROUPED(uint32_t, 32)
DEFINE_GROUPED(uint64_t, 64)

/* The compiler specialises each kernel per op when the op is a constant. */
#define DISPATCH(fn, elem, op, tmp, ...)                                                   \
    do {                                                                                   \
        if ((op) == OP_GSUB) {                                                             \
            Py_ssize_t start_[NKEYS];                                                      \
            if ((elem) == 2) g##fn##_16(__VA_ARGS__, tmp, start_);                         \
            else if ((elem) == 4) g##fn##_32(__VA_ARGS__, tmp, start_);                    \
            else g##fn##_64(__VA_ARGS__, tmp, start_);                                     \
        } else if ((op) == OP_PLAIN) {                                                     \
            if ((elem) == 2) fn##_16(__VA_ARGS__, OP_PLAIN);                               \
            else if ((elem) == 4) fn##_32(__VA_ARGS__, OP_PLAIN);                          \
            else fn##_64(__VA_ARGS__, OP_PLAIN);                                           \
        } else if ((op) == OP_XOR) {                                                       \
            if ((elem) == 2) fn##_16(__VA_ARGS__, OP_XOR);                                 \
            else if ((elem) == 4) fn##_32(__VA_ARGS__, OP_XOR);                            \
            else fn##_64(__VA_ARGS__, OP_XOR);                                             \
        } else {                                                                           \
            if ((elem) == 2) fn##_16(__VA_ARGS__, OP_SUB);                                 \
            else if ((elem) == 4) fn##_32(__VA_ARGS__, OP_SUB);                            \
            else fn##_64(__VA_ARGS__, OP_SUB);                                             \
        }                                                                                  \
    } while (0)

/* Both entry points take (data, base, dst, elem, op[, scratch]); -1 with an exception set if any is off. */
static int parse_args(PyObject *args, PyObject **data, PyObject **base, PyObject **dst, int *elem, int *op,
                      PyObject **scratch) {
    *scratch = Py_None;
    if (!PyArg_ParseTuple(args, "OOOii|O", data, base, dst, elem, op, scratch)) return -1;
    if (*elem != 2 && *elem != 4 && *elem != 8) {
        PyErr_Format(PyExc_ValueError, "element size must be 2, 4 or 8, not %d", *elem);
        return -1;
    }
    if (*op < OP_PLAIN || *op > OP_GSUB) {
        PyErr_Format(PyExc_ValueError, "unknown op %d", *op);
        return -1;
    }
    return 0;
}

/* The grouped op's working array: the caller's writable buffer of at least `need` bytes,
 * aligned to the element size (the caller keeps one per thread; nothing is kept here). */
static int get_scratch(PyObject *o, Py_buffer *v, Py_ssize_t need, int elem) {
    if (o == Py_None) {
        PyErr_SetString(PyExc_ValueError, "op 3 needs a scratch buffer as large as the data");
        return -1;
    }
    if (PyObject_GetBuffer(o, v, PyBUF_WRITABLE) < 0) return -1;
    if (v->len < need || (uintptr_t)v->buf % (uintptr_t)elem) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_ValueError, "scratch buffer too small or not aligned to the element size");
        return -1;
    }
    return 0;
}

/* encode(src, base, dst, elem, op[, scratch]): dst (plane-major) <- planes of op(src, base).
 * base may be None for op 0. */
static PyObject *native_encode(PyObject *self, PyObject *args) {
    PyObject *src_o, *base_o, *dst_o, *scratch_o;
    int elem, op;
    if (parse_args(args, &src_o, &base_o, &dst_o, &elem, &op, &scratch_o) < 0) return NULL;
    Py_buffer src, base = {0}, dst, tmp = {0};
    int have_src = 0, have_dst = 0, have_base = 0, have_tmp = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_SIMPLE) < 0) goto done;
    have_src = 1;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_WRITABLE) < 0) goto done;
    have_dst = 1;
    if (op != OP_PLAIN) {
        if (PyObject_GetBuffer(base_o, &base, PyBUF_SIMPLE) < 0) goto done;
        have_base = 1;
    }
    if (src.len % elem || dst.len != src.len || (have_base && base.len != src.len)) {
        PyErr_SetString(PyExc_ValueError, "buffers must have the same length, a multiple of the element size");
        goto done;
    }
    if (op == OP_GSUB) {
        if (get_scratch(scratch_o, &tmp, src.len, elem) < 0) goto done;
        have_tmp = 1;
    }
    {
        Py_ssize_t n = src.len / elem;
        const uint8_t *s = src.buf, *b = have_base ? base.buf : NULL;
        uint8_t *d = dst.buf, *t = have_tmp ? tmp.buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        DISPATCH(encode, elem, (op_t)op, t, s, b, d, n);
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (have_src) PyBuffer_Release(&src);
    if (have_dst) PyBuffer_Release(&dst);
    if (have_base) PyBuffer_Release(&base);
    if (have_tmp) PyBuffer_Release(&tmp);
    return ret;
}

/* decode(planes, base, dst, elem, op[, scratch]): dst <- op^-1(interleave(planes), base).
 * planes: elem buffers of n bytes. */
static PyObject *native_decode(PyObject *self, PyObject *args) {
    PyObject *planes_o, *base_o, *dst_o, *scratch_o;
    int elem, op;
    if (parse_args(args, &planes_o, &base_o, &dst_o, &elem, &op, &scratch_o) < 0) return NULL;
    PyObject *seq = PySequence_Fast(planes_o, "planes must be a sequence of buffers");
    if (seq == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != elem) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "need %d planes", elem);
    }
    Py_buffer pv[MAX_ELEM], base = {0}, dst, tmp = {0};
    int got = 0, have_base = 0, have_dst = 0, have_tmp = 0;
    PyObject *ret = NULL;
    for (; got < elem; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &pv[got], PyBUF_SIMPLE) < 0) goto done;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_WRITABLE) < 0) goto done;
    have_dst = 1;
    if (op != OP_PLAIN) {
        if (PyObject_GetBuffer(base_o, &base, PyBUF_SIMPLE) < 0) goto done;
        have_base = 1;
    }
    if (dst.len % elem || (have_base && base.len != dst.len)) {
        PyErr_SetString(PyExc_ValueError, "dst and base must have the same length, a multiple of the element size");
        goto done;
    }
    Py_ssize_t n = dst.len / elem;
    uint8_t *p[MAX_ELEM];
    for (int k = 0; k < elem; k++) {
        if (pv[k].len != n) {
            PyErr_Format(PyExc_ValueError, "plane %d has %zd bytes, expected %zd", k, pv[k].len, n);
            goto done;
        }
        p[k] = pv[k].buf;
    }
    if (op == OP_GSUB) {
        if (get_scratch(scratch_o, &tmp, dst.len, elem) < 0) goto done;
        have_tmp = 1;
    }
    {
        const uint8_t *b = have_base ? base.buf : NULL;
        uint8_t *d = dst.buf, *t = have_tmp ? tmp.buf : NULL;
        uint8_t *const *pp = p;
        Py_BEGIN_ALLOW_THREADS
        DISPATCH(decode, elem, (op_t)op, t, pp, b, d, n);
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&pv[k]);
    if (have_dst) PyBuffer_Release(&dst);
    if (have_base) PyBuffer_Release(&base);
    if (have_tmp) PyBuffer_Release(&tmp);
    Py_DECREF(seq);
    return ret;
}

static PyMethodDef methods[] = {
    {"encode", native_encode, METH_VARARGS,
     "encode(src, base, dst, elem, op[, scratch]): write the byte planes of op(src, base) into dst, plane-major "
     "(op 0: src itself, 1: XOR, 2: zigzag of the ordered-integer difference, 3: op 2 with the elements "
     "in a stable order by the 10 bits below the sign bit of base; it needs `scratch`, a writable buffer "
     "as large as src, aligned to the element size)."},
    {"decode", native_decode, METH_VARARGS,
     "decode(planes, base, dst, elem, op[, scratch]): interleave `elem` planes and undo op against base, "
     "into dst (op 3 needs `scratch` as encode does)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ckpt._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
