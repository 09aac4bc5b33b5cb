"""The model runner (apply a diff, run the model, sample) and its start-up: the checks before
weights load, whether model and KV cache fit, KV sizing, host memory, a simulated device."""
