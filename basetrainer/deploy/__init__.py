"""Ship the trained model: export it to ONNX, MNN, NCNN and OpenVINO, check every export against
eager PyTorch, run it through the original's inference engines, and time it.

The rooms of this package (an application: it uses the runtime, builders and pruning layers):

- :mod:`.source`: the model to export, from a module (wrappers looked through) or a file
  (weights, ``last.pth``, a sharded ``last.pth``, a pruned model's file).
- :mod:`.inputs`: the one image input the model takes (its channels, its size), checked first.
- :mod:`.onnx_format`, :mod:`.converters`: writing each format (ONNX with its fp16 and int8
  variants; MNN, NCNN through pnnx, OpenVINO IR); :mod:`.files` makes them land atomically,
  and a full disk one clear error.
- :mod:`.engines`: one inference engine per runtime (``ONNXEngine``, ``MNNEngine``,
  ``NCNNEngine``, ``OpenVINOEngine``; ``TRTEngine`` and ``RKNNEngine`` need their hardware).
- :mod:`.parity`, :mod:`.latency`: how far an export is from eager PyTorch, and how fast it runs.
- :mod:`.formats`, :mod:`.export`, :mod:`.report`: the formats by name, the export-and-check
  run, and its table; ``python -m basetrainer.deploy`` is its command line.

Every runtime is an optional dependency, imported only by the function that needs it
(:mod:`.runtimes`); a missing one is an error naming its pip command.
"""
