"""LoRA adapters on the worker: PEFT directories loaded at start (adapter.py) and the linear
layers that add each token row's adapter delta (layers.py). docs/lora.md."""
