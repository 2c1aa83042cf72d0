"""Execution providers and fragment flavours: onnxruntime's providers and the RKNN backend."""
