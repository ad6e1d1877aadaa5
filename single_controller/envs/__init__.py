"""Environments for multi-turn rollouts: the contract (`contract`), its two transports (in-process
`inprocess`, HTTP `http_client` / `http_server`) and tool-call parsing (`tool_calls`)."""
