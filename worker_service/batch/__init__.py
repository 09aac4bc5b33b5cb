"""The requests a worker holds across steps: each one's cached copy, the persistent batch of per-row
arrays, and the check a decoded diff passes before any of it is applied."""
