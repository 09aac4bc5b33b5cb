"""What the tests share: harnesses for processes, clusters and simulated workers, reference
runs of transformers, and small builders. Nothing here is a test."""
