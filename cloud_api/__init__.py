"""specrelay cloud verification API (aiohttp): sessions, batched target verification,
staged correction. See ``cloud_api.app.create_app``."""
