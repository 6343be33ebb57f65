"""The worker process: an engine behind the request plane, registered in discovery."""
