"""Feishu/Lark channel (lark-oapi)."""
