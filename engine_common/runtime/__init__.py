"""The process around the engine: where files live, the garbage collector kept off the start-up
heap, big-stack threads, strongly connected components, the /metrics endpoint, the progress lines
a long start-up step prints."""
