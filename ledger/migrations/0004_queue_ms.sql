-- How long flow control held the request in its queue (llmgw.outcome.Outcome.queue_ms); null:
-- it did not pass through flow control (and every row before this column).
ALTER TABLE outcomes ADD COLUMN queue_ms double precision;
