"""The websocket peers the backend holds: hook connections by job and rank, and the frame
and byte budgets every peer connection gets. Below control and the dashboard, which send
through them; the conversations (ingest/websocket.py, the dashboard socket) sit above."""
