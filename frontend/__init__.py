"""The dashboard's static files (HTML, ES modules, CSS), shipped as package data: the backend
serves them from here (``importlib.resources.files("frontend")``) in a source tree and in a
plain install alike. No Python lives here."""
