"""What ckpt writes and reads, pure and without I/O: manifests (manifest.py), the safetensors
header (safetensors_header.py), dtypes (dtypes.py) and the tagged JSON of non-tensor values
(values.py). docs/format.md is the spec."""
