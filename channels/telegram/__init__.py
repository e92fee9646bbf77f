"""The Telegram channel (aiogram 3): polling or webhook in, live-edited replies out."""
