"""Planning: a profile in, a plan out. No grpc, no protos, no live session, no torch:
usable offline (`hetlaunch plan --profile`), from benchmarks, and tested alone."""
