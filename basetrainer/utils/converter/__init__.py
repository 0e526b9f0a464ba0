"""The original's converters (``pytorch2onnx``, ``onnx2mnn``, ``onnx2ncnn``, ``pytorch2ncnn``,
``onnx2trt``) with their signatures: entry points onto :mod:`basetrainer.deploy`, where the
exports are written atomically and checked against the model before they are called done."""
