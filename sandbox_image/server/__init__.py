"""The sandbox's gRPC server and, per loaded function version, its pool of slot processes."""
