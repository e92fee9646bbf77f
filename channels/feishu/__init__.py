"""The Feishu / Lark channel (lark-oapi). This build has its settings, rendering, inbound normalisation and
approval cards; ``chatbridge run`` still refuses to enable it."""
