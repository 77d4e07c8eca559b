"""Optional integrations with training frameworks, one module each, imported only on request.

- :mod:`ckpt.integrations.lightning`: ``CkptCallback`` for PyTorch Lightning
  (``pip install 'ckpt-store[lightning]'``).
- :mod:`ckpt.integrations.transformers`: ``CkptCallback`` for the Hugging Face
  ``Trainer`` (``pip install 'ckpt-store[transformers]'``).

``import ckpt`` never imports these frameworks.
"""
