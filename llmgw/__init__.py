"""llmgw: shared configuration, telemetry, wire constants, CLI and launcher."""
