"""Attachments: files people send with a message, fetched, bounded, stored and read for the model.

- ``fetch``: the seam a channel implements to download an attachment with its platform's API;
- ``files``: the media directory under ``data_dir`` (bounded streamed writes, ids as the only file names);
- ``sniff``: what a file is, from its bytes;
- ``digest``: what the model can read of a stored file (image limits, document and PDF text);
- ``transcribe``: voice and audio through an OpenAI-compatible ``/audio/transcriptions`` endpoint;
- ``intake``: a message's attachments, from the channel to stored references (the turn's first step);
- ``describe``: attachments in the words and parts the model is sent;
- ``vision``: whether images go to the model as images.
"""
