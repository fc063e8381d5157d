-- What each admission drew from the fleet's borrowing pool (llmgw.outcome.Outcome); 0: base quota.
ALTER TABLE outcomes
    ADD COLUMN borrowed_requests integer NOT NULL DEFAULT 0,
    ADD COLUMN borrowed_tokens   bigint  NOT NULL DEFAULT 0;
