"""Attachment test data made on the spot: images, PDFs (with text, or a decompression bomb), voice notes."""

from __future__ import annotations

import io
import zlib

from PIL import Image


def jpeg(width: int = 64, height: int = 48, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "JPEG", quality=80)
    return out.getvalue()


def png(width: int = 32, height: int = 32) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", (width, height), (0, 120, 255, 200)).save(out, "PNG")
    return out.getvalue()


def png_bomb(side: int = 20_000) -> bytes:
    """A PNG of ``side``² pixels (400 megapixels by default) that is a few kilobytes on disk."""
    out = io.BytesIO()
    Image.new("1", (side, side)).save(out, "PNG", optimize=True)
    return out.getvalue()


def voice_ogg(size: int = 4000) -> bytes:
    """Bytes that start like an Ogg/Opus voice note (what Telegram sends), padded to ``size``."""
    head = b"OggS\x00\x02" + b"\x00" * 20 + b"\x01\x13OpusHead\x01\x01\x38\x01\x80\xbb\x00\x00\x00\x00\x00"
    return head + bytes(max(0, size - len(head)))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _document(contents: list[bytes], *, filters: list[bool]) -> bytes:
    """A PDF whose pages have the given content streams (compressed where ``filters`` says so)."""
    objects: list[bytes] = []
    pages = len(contents)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    for i, (content, flate) in enumerate(zip(contents, filters, strict=True)):
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R "
                       f">> >> /Contents {5 + 2 * i} 0 R >>".encode())
        extra = b" /Filter /FlateDecode" if flate else b""
        objects.append(b"<< /Length " + str(len(content)).encode() + extra + b" >>\nstream\n" + content
                       + b"\nendstream")
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for offset in offsets:
        out += f"{offset:010d} 00000 n \n".encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def pdf(pages: list[list[str]]) -> bytes:
    """A PDF with one page per entry, each line of it set in Helvetica."""
    contents = []
    for lines in pages:
        ops = ["BT", "/F1 11 Tf", "14 TL", "72 740 Td"]
        for line in lines:
            ops.append(f"({_escape(line)}) Tj T*")
        ops.append("ET")
        contents.append("\n".join(ops).encode("latin-1"))
    return _document(contents, filters=[False] * len(contents))


def pdf_bomb(unpacked: int = 200 * 1024 * 1024) -> bytes:
    """A one-page PDF of a few hundred kilobytes whose content stream inflates to ``unpacked`` bytes."""
    packer = zlib.compressobj(9)
    chunk = b" " * (1024 * 1024)
    parts = [packer.compress(chunk) for _ in range(unpacked // len(chunk))]
    parts.append(packer.flush())
    return _document([b"".join(parts)], filters=[True])
