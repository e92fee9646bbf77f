"""The Slack channel (slack-bolt, async): rendering, inbound normalisation and approval blocks."""
