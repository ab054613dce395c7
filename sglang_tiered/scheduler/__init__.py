"""Reserved for later mechanisms; see ARCHITECTURE.md."""
