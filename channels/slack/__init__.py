"""The Slack channel (slack-bolt, async). This build has its settings, rendering, inbound normalisation and
approval blocks; ``chatbridge run`` still refuses to enable it."""
