"""What ckpt writes and reads, pure and without I/O: manifests (manifest.py; a pushed .pt's structure in
one, structure.py; the names and paths it holds, names.py), the safetensors header (safetensors_header.py),
dtypes (dtypes.py) and the tagged JSON of non-tensor values (tagged_json.py, tensor_values.py).
docs/format.md is the spec."""
