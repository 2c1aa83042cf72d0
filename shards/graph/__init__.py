"""ONNX layer fragments: their spec, how they are built from stored weights and cached."""
