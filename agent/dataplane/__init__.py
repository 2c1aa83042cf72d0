"""The data plane's links: persistent WebSockets between stages carrying step, result, error, close and ping frames."""
