-- Whether the rate-limit service decided the admission (llmgw.outcome.Outcome); false for a
-- request that reached a pod: the service failed open. Rows before this column: unknown, false.
ALTER TABLE outcomes ADD COLUMN quota_checked boolean NOT NULL DEFAULT false;
