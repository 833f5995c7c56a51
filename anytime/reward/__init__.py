"""Verifiable math rewards: answer extraction and normalisation (`answer`), the deduplicating
verifier (`verifier`) and its pool of killable worker processes (`pool`)."""
