"""End-of-run reports: build (pure), collect (I/O, the owner), html (self-contained page)."""
