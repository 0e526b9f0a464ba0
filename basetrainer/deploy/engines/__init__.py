"""One inference engine per runtime, with the original's keywords (see :mod:`.base`):
:mod:`.onnx_runtime` (``ONNXEngine``), :mod:`.mnn_runtime` (``MNNEngine``), :mod:`.ncnn_runtime`
(``NCNNEngine``), :mod:`.openvino_runtime` (``OpenVINOEngine``) and :mod:`.hardware`
(``TRTEngine``, ``RKNNEngine``). Importing them imports no runtime; building one does."""
