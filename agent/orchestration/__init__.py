"""The orchestrator: deploying plans, the token loop of each request, failover and degraded mode."""
