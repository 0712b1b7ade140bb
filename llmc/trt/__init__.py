"""The TensorRT backend: the plan builder (plan.py). Imported only for --backend tensorrt."""
