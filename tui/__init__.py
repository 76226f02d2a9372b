"""`localllm chat`: a terminal chat UI (Textual).

app (layout, keys, worker threads), session (conversation, replies, cancellation, QDEC on/off: no widgets),
transcript / settings / loading (widgets), facts (what the status bar and settings say), history (saving a chat).
"""
