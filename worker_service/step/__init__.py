"""One step's model inputs: flattened from the batch, staged in persistent host/device arenas,
the padded decode buffers and CUDA graphs that replay them, and the step's host clock."""
