"""The Slack channel. This build has its settings only; ``chatbridge run`` refuses to enable it."""
