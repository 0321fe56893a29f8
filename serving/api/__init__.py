"""The HTTP and gRPC front: the gRPC server, the OpenAI-compatible and Responses routes, request bodies, tool
calling, auth, the calls between APIs, the gRPC client."""
