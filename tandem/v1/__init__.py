"""Generated gRPC stubs (python -m tandem.gen_proto); edit proto/tandem/v1/*.proto instead."""
