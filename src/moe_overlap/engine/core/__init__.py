"""The schedule core: step data, the runner, nodes, plans, streams and state."""
