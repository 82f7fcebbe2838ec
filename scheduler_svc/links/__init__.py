"""The gRPC adapters of the internal port: WorkerLink (workers) and FrontendLink (front-ends
apart). Thin: they parse, check and hand over to the engine."""
