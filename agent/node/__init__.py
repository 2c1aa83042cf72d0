"""The agent process: the application's wiring, the internal endpoints and the serve loop."""
