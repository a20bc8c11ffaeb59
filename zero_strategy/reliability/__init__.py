"""What stops misuse before it trains wrongly: the stage-3 parameter guard (guard), the
checks on the user's calls (misuse) and the setup check at initialize (fingerprint)."""
