"""What keeps a job to its members: the job secret, authenticated heals in a format that
cannot run code (docs/security.md)."""
