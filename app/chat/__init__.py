"""The chat window: the transcript, the message box, conversations on disk, versions of answers, files in and out, and
the context the conversation uses."""
