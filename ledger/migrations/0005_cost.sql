-- What each request cost at the price table's prices (llmgw/prices.py), in integer micro-units
-- of `currency` (0 and '': unpriced, as every row before these columns), and its estimated GPU
-- time (ledger/gputime.py; null: unknown).
ALTER TABLE outcomes
  ADD COLUMN cost_micros bigint NOT NULL DEFAULT 0,
  ADD COLUMN currency text NOT NULL DEFAULT '',
  ADD COLUMN gpu_seconds double precision;
