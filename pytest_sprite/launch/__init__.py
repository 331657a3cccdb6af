"""Controller side: starting rank agents, driving ranks tests, merging their reports."""
