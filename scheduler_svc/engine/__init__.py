"""The request side of the scheduler: the global queue, admission, placement and the per-worker
step loops (ServingEngine), each request's in-flight record and each worker's session."""
