"""The Feishu Open API fake through the real lark-oapi client: tokens, messages with the uuid key, reactions,
CardKit streaming with the sequence check, business errors as the SDK's response objects, and faults."""

from __future__ import annotations

import json

import httpx
import lark_oapi as lark
import pytest
from lark_oapi.api.cardkit.v1 import (
    BatchUpdateCardRequest,
    BatchUpdateCardRequestBody,
    ContentCardElementRequest,
    ContentCardElementRequestBody,
    CreateCardRequest,
    CreateCardRequestBody,
    SettingsCardRequest,
    SettingsCardRequestBody,
)
from lark_oapi.api.im.v1 import (
    CreateMessageReactionRequest,
    CreateMessageReactionRequestBody,
    CreateMessageRequest,
    CreateMessageRequestBody,
    DeleteMessageReactionRequest,
    DeleteMessageRequest,
    Emoji,
    GetMessageResourceRequest,
    PatchMessageRequest,
    PatchMessageRequestBody,
    ReplyMessageRequest,
    ReplyMessageRequestBody,
    UpdateMessageRequest,
    UpdateMessageRequestBody,
)

from tests.fakes.feishu import FakeFeishu
from tests.fakes.feishu.harness import CHAT  # the group chat `fake_feishu` starts with


def sdk(fake: FakeFeishu, timeout: float = 5.0) -> lark.Client:
    return (lark.Client.builder().app_id(fake.app_id).app_secret(fake.app_secret).domain(fake.base_url)
            .timeout(timeout).log_level(lark.LogLevel.ERROR).build())


def text_message(text: str, *, uuid: str | None = None, chat: str = CHAT) -> CreateMessageRequest:
    body = CreateMessageRequestBody.builder().receive_id(chat).msg_type("text").content(json.dumps({"text": text}))
    if uuid:
        body = body.uuid(uuid)
    return CreateMessageRequest.builder().receive_id_type("chat_id").request_body(body.build()).build()


def reply(message_id: str, msg_type: str, content: dict, *, uuid: str | None = None) -> ReplyMessageRequest:
    body = ReplyMessageRequestBody.builder().msg_type(msg_type).content(json.dumps(content))
    if uuid:
        body = body.uuid(uuid)
    return ReplyMessageRequest.builder().message_id(message_id).request_body(body.build()).build()


def streaming_card(text: str = "…") -> dict:
    return {"schema": "2.0", "config": {"streaming_mode": True, "update_multi": True},
            "body": {"elements": [{"tag": "markdown", "element_id": "answer", "content": text}]}}


async def create_card(client: lark.Client, card: dict) -> str:
    body = CreateCardRequestBody.builder().type("card_json").data(json.dumps(card)).build()
    resp = await client.cardkit.v1.card.acreate(CreateCardRequest.builder().request_body(body).build())
    assert resp.code == 0, resp.msg
    return str(resp.data.card_id)


def content(card_id: str, text: str, sequence: int, uuid: str | None = None) -> ContentCardElementRequest:
    body = ContentCardElementRequestBody.builder().content(text).sequence(sequence)
    if uuid:
        body = body.uuid(uuid)
    return (ContentCardElementRequest.builder().card_id(card_id).element_id("answer").request_body(body.build())
            .build())


def settings(card_id: str, config: dict, sequence: int) -> SettingsCardRequest:
    body = SettingsCardRequestBody.builder().settings(json.dumps({"config": config})).sequence(sequence).build()
    return SettingsCardRequest.builder().card_id(card_id).request_body(body).build()


async def test_a_repeated_uuid_returns_the_first_message_and_posts_once(fake_feishu):
    client = sdk(fake_feishu)
    first = await client.im.v1.message.acreate(text_message("hello", uuid="send-1"))
    again = await client.im.v1.message.acreate(text_message("hello", uuid="send-1"))
    other = await client.im.v1.message.acreate(text_message("hello", uuid="send-2"))
    assert first.code == again.code == other.code == 0
    assert again.data.message_id == first.data.message_id != other.data.message_id
    assert fake_feishu.texts(CHAT) == ["hello", "hello"]
    assert fake_feishu.count("token") == 1  # the SDK caches the tenant token


def resource(message_id: str, key: str, kind: str) -> GetMessageResourceRequest:
    return GetMessageResourceRequest.builder().message_id(message_id).file_key(key).type(kind).build()


async def test_message_resources_through_the_sdks_typed_api(fake_feishu):
    client = sdk(fake_feishu)
    msg = fake_feishu.user_message(CHAT, msg_type="file", content={"file_key": "file_v3_a", "file_name": "a.pdf"})
    fake_feishu.add_resource(msg, "file_v3_a", b"%PDF-1.4 bytes", content_type="application/pdf", file_name="a.pdf")
    got = await client.im.v1.message_resource.aget(resource(msg.message_id, "file_v3_a", "file"))
    assert got.code == 0 and got.file is not None and got.file.read() == b"%PDF-1.4 bytes"
    headers = {k.lower(): v for k, v in got.raw.headers.items()}
    assert headers["content-type"] == "application/pdf"
    assert headers["content-disposition"] == 'attachment; filename="a.pdf"'
    assert fake_feishu.downloads == [(msg.message_id, "file_v3_a", "file")]

    async def refusal(message_id: str, kind: str) -> tuple[int, int]:
        # lark-oapi's aget looks up "Content-Type" in httpx's lower-cased headers, so it never reads an error
        # body into ``code``: the answer is read from the raw response
        got = await client.im.v1.message_resource.aget(resource(message_id, "file_v3_a", kind))
        return got.raw.status_code, json.loads(got.raw.content)["code"]

    assert await refusal(msg.message_id, "image") == (400, 234001)  # a file asked for as an image
    other = fake_feishu.user_message(CHAT, "hi")
    assert await refusal(other.message_id, "file") == (400, 234003)  # the key is not in that message
    fake_feishu.rate_limit("message_resource.get", reset=3)
    assert await refusal(msg.message_id, "file") == (429, 99991400)
    limited = fake_feishu.calls_to("message_resource.get")[-1]
    assert limited.status == 429
    assert len(fake_feishu.downloads) == 1


async def test_bot_info_through_the_sdks_raw_request(fake_feishu):
    request = (lark.BaseRequest.builder().http_method(lark.HttpMethod.GET).uri("/open-apis/bot/v3/info")
               .token_types({lark.AccessTokenType.TENANT}).build())
    resp = await sdk(fake_feishu).arequest(request)
    assert resp.code == 0
    assert json.loads(resp.raw.content)["bot"]["open_id"] == fake_feishu.bot_open_id


async def test_a_reply_quotes_the_user_message_and_a_recalled_one_cannot_be_answered(fake_feishu):
    client = sdk(fake_feishu)
    asked = fake_feishu.user_message(CHAT, "what is 2+2?")
    resp = await client.im.v1.message.areply(reply(asked.message_id, "text", {"text": "4"}, uuid="r-1"))
    assert resp.code == 0
    [shown] = fake_feishu.shown(CHAT)
    assert (shown.parent_id, shown.root_id, fake_feishu.text_of(shown)) == (asked.message_id, asked.message_id, "4")
    asked.deleted = True
    gone = await client.im.v1.message.areply(reply(asked.message_id, "text", {"text": "4"}))
    assert (gone.code, gone.raw.status_code) == (230011, 400)


async def test_edit_patch_and_recall(fake_feishu):
    client = sdk(fake_feishu)
    sent = await client.im.v1.message.acreate(text_message("draft"))
    mid = sent.data.message_id
    body = UpdateMessageRequestBody.builder().msg_type("text").content(json.dumps({"text": "final"})).build()
    edited = await client.im.v1.message.aupdate(UpdateMessageRequest.builder().message_id(mid).request_body(body)
                                                .build())
    assert edited.code == 0 and fake_feishu.texts(CHAT) == ["final"]
    card = {"config": {"update_multi": True}, "elements": [{"tag": "markdown", "content": "v1"}]}
    posted = await client.im.v1.message.areply(reply(mid, "interactive", card))
    card["elements"][0]["content"] = "v2"
    patch = PatchMessageRequestBody.builder().content(json.dumps(card)).build()
    patched = await client.im.v1.message.apatch(
        PatchMessageRequest.builder().message_id(posted.data.message_id).request_body(patch).build())
    assert patched.code == 0 and fake_feishu.texts(CHAT) == ["final", "v2"]
    not_text = await client.im.v1.message.aupdate(
        UpdateMessageRequest.builder().message_id(posted.data.message_id).request_body(body).build())
    assert not_text.code == 230054
    recalled = await client.im.v1.message.adelete(DeleteMessageRequest.builder().message_id(mid).build())
    assert recalled.code == 0 and fake_feishu.texts(CHAT) == ["v2"]
    twice = await client.im.v1.message.adelete(DeleteMessageRequest.builder().message_id(mid).build())
    assert twice.code == 230011


async def test_a_message_over_the_size_limit_is_refused(fake_feishu):
    client = sdk(fake_feishu)
    resp = await client.im.v1.message.acreate(text_message("x" * (150 * 1024 + 1)))
    assert (resp.code, resp.raw.status_code) == (230025, 400)
    assert fake_feishu.shown(CHAT) == []


async def test_reactions_on_the_user_message(fake_feishu):
    client = sdk(fake_feishu)
    asked = fake_feishu.user_message(CHAT, "hi")
    body = CreateMessageReactionRequestBody.builder().reaction_type(Emoji.builder().emoji_type("OnIt").build()).build()
    added = await client.im.v1.message_reaction.acreate(
        CreateMessageReactionRequest.builder().message_id(asked.message_id).request_body(body).build())
    assert added.code == 0 and list(asked.reactions.values()) == ["OnIt"]
    removed = await client.im.v1.message_reaction.adelete(
        DeleteMessageReactionRequest.builder().message_id(asked.message_id).reaction_id(added.data.reaction_id)
        .build())
    assert removed.code == 0 and asked.reactions == {}


async def test_a_streaming_card_sent_by_id_shows_its_latest_content_and_sequences_must_increase(fake_feishu):
    client = sdk(fake_feishu)
    asked = fake_feishu.user_message(CHAT, "tell me")
    card_id = await create_card(client, streaming_card())
    sent = await client.im.v1.message.areply(reply(asked.message_id, "interactive",
                                                   {"type": "card", "data": {"card_id": card_id}}, uuid="c-1"))
    assert sent.code == 0
    assert (await client.cardkit.v1.card_element.acontent(content(card_id, "Hello", 1))).code == 0
    assert (await client.cardkit.v1.card_element.acontent(content(card_id, "Hello world", 2))).code == 0
    stale = await client.cardkit.v1.card_element.acontent(content(card_id, "Hello", 2))
    assert (stale.code, stale.raw.status_code) == (300317, 400)
    assert fake_feishu.texts(CHAT) == ["Hello world"]
    closed = await client.cardkit.v1.card.asettings(settings(card_id, {"streaming_mode": False}, 3))
    assert closed.code == 0 and not fake_feishu.cards[card_id].streaming
    late = await client.cardkit.v1.card_element.acontent(content(card_id, "Hello world!", 4))
    assert late.code == 300309
    assert fake_feishu.cards[card_id].sequences == [1, 2, 3]


async def test_streaming_mode_closes_by_itself_after_ten_minutes(fake_feishu):
    now = [5000.0]
    fake_feishu.clock = lambda: now[0]
    client = sdk(fake_feishu)
    card_id = await create_card(client, streaming_card())
    assert (await client.cardkit.v1.card_element.acontent(content(card_id, "a", 1))).code == 0
    now[0] += 600
    late = await client.cardkit.v1.card_element.acontent(content(card_id, "ab", 2))
    assert late.code == 200850 and not fake_feishu.cards[card_id].streaming
    reopened = await client.cardkit.v1.card.asettings(settings(card_id, {"streaming_mode": True}, 3))
    assert reopened.code == 0
    assert (await client.cardkit.v1.card_element.acontent(content(card_id, "ab", 4))).code == 0


async def test_a_repeated_cardkit_uuid_is_applied_once(fake_feishu):
    client = sdk(fake_feishu)
    card_id = await create_card(client, streaming_card())
    first = await client.cardkit.v1.card_element.acontent(content(card_id, "abc", 1, uuid="op-1"))
    again = await client.cardkit.v1.card_element.acontent(content(card_id, "abc", 1, uuid="op-1"))
    assert first.code == again.code == 0
    conflict = await client.cardkit.v1.card_element.acontent(content(card_id, "abcd", 2, uuid="op-1"))
    assert conflict.code == 200770


async def test_a_card_over_30_kb_is_refused_and_keeps_its_content(fake_feishu):
    client = sdk(fake_feishu)
    card_id = await create_card(client, streaming_card())
    assert (await client.cardkit.v1.card_element.acontent(content(card_id, "short", 1))).code == 0
    huge = await client.cardkit.v1.card_element.acontent(content(card_id, "好" * 11_000, 2))
    assert huge.code == 200860
    assert fake_feishu.cards[card_id].element("answer")["content"] == "short"
    assert fake_feishu.cards[card_id].sequence == 1  # a refused operation does not use up its sequence


async def test_batch_update_adds_buttons_and_closes_streaming(fake_feishu):
    client = sdk(fake_feishu)
    card_id = await create_card(client, streaming_card("answer"))
    actions = [{"action": "add_elements", "params": {"type": "append", "elements": [
        {"tag": "button", "element_id": "allow", "text": {"tag": "plain_text", "content": "Allow"},
         "behaviors": [{"type": "callback", "value": {"d": "allow"}}]}]}},
        {"action": "partial_update_setting", "params": {"settings": {"config": {"streaming_mode": False}}}}]
    body = BatchUpdateCardRequestBody.builder().sequence(1).actions(json.dumps(actions)).build()
    resp = await client.cardkit.v1.card.abatch_update(
        BatchUpdateCardRequest.builder().card_id(card_id).request_body(body).build())
    assert resp.code == 0
    card = fake_feishu.cards[card_id]
    assert card.buttons == [("Allow", {"d": "allow"})] and not card.streaming


async def test_rate_limit_reaches_the_sdk_with_status_code_and_reset_header(fake_feishu):
    client = sdk(fake_feishu)
    fake_feishu.rate_limit("message.create", reset=30)
    fake_feishu.chat_rate_limit("message.create")
    limited = await client.im.v1.message.acreate(text_message("one"))
    assert (limited.code, limited.raw.status_code) == (99991400, 429)
    assert limited.raw.headers["x-ogw-ratelimit-reset"] == "30"  # httpx hands headers over lower-cased
    per_chat = await client.im.v1.message.acreate(text_message("one"))
    assert (per_chat.code, per_chat.raw.status_code) == (230020, 400)
    ok = await client.im.v1.message.acreate(text_message("one"))
    assert ok.code == 0 and fake_feishu.texts(CHAT) == ["one"]


async def test_a_revoked_token_is_refused_until_the_client_fetches_a_new_one(fake_feishu):
    client = sdk(fake_feishu)
    assert (await client.im.v1.message.acreate(text_message("a"))).code == 0
    fake_feishu.revoke_tokens()
    refused = await client.im.v1.message.acreate(text_message("b"))
    assert refused.code == 99991663
    # the SDK keeps its cached token: it never refreshes on its own (the channel must drop it)
    assert (await client.im.v1.message.acreate(text_message("b"))).code == 99991663
    assert fake_feishu.count("token") == 1


async def test_a_token_fetched_with_the_async_api_and_passed_per_call_never_blocks_on_requests(fake_feishu):
    """With ``enable_set_token`` the SDK fetches nothing itself; the token comes from the typed async token
    API (which needs no token, so nothing blocks) and rides on each call's RequestOption."""
    client = (lark.Client.builder().app_id(fake_feishu.app_id).app_secret(fake_feishu.app_secret)
              .domain(fake_feishu.base_url).enable_set_token(True).timeout(5).log_level(lark.LogLevel.ERROR).build())
    body = (lark.auth.v3.InternalTenantAccessTokenRequestBody.builder().app_id(fake_feishu.app_id)
            .app_secret(fake_feishu.app_secret).build())
    got = await client.auth.v3.tenant_access_token.ainternal(
        lark.auth.v3.InternalTenantAccessTokenRequest.builder().request_body(body).build())
    assert got.code == 0 and got.data is None  # the token is at the top level, not under "data"
    token = json.loads(got.raw.content)["tenant_access_token"]
    option = lark.RequestOption.builder().tenant_access_token(token).build()
    sent = await client.im.v1.message.acreate(text_message("hi"), option)
    assert sent.code == 0 and fake_feishu.texts(CHAT) == ["hi"]
    fake_feishu.revoke_tokens()
    assert (await client.im.v1.message.acreate(text_message("again"), option)).code == 99991663
    assert [c.route for c in fake_feishu.calls] == ["token", "message.create", "message.create"]


async def test_token_rotation_follows_feishu(fake_feishu):
    now = [1000.0]
    fake_feishu.clock = lambda: now[0]
    body = {"app_id": fake_feishu.app_id, "app_secret": fake_feishu.app_secret}
    async with httpx.AsyncClient(base_url=fake_feishu.base_url) as http:
        url = "/open-apis/auth/v3/tenant_access_token/internal"
        a = (await http.post(url, json=body)).json()
        now[0] += 3600  # 1 h left: the same token comes back
        b = (await http.post(url, json=body)).json()
        now[0] += 2000  # less than 30 min left: a new one, the old one still valid
        c = (await http.post(url, json=body)).json()
        wrong = (await http.post(url, json={**body, "app_secret": "nope"})).json()
    assert a["tenant_access_token"] == b["tenant_access_token"] != c["tenant_access_token"]
    assert (a["expire"], b["expire"], c["expire"]) == (7200, 3600, 7200)
    assert set(fake_feishu.tokens) == {a["tenant_access_token"], c["tenant_access_token"]}
    assert wrong["code"] == 10014


async def test_a_gateway_5xx_page_and_a_hang_surface_as_sdk_exceptions(fake_feishu):
    client = sdk(fake_feishu, timeout=0.5)
    fake_feishu.fail("message.create", status=502, raw_body="<html>502 Bad Gateway</html>")
    with pytest.raises(json.JSONDecodeError):  # the SDK parses every body as JSON
        await client.im.v1.message.acreate(text_message("x"))
    fake_feishu.fail("message.create", hang=2.0)
    with pytest.raises(httpx.TimeoutException):
        await client.im.v1.message.acreate(text_message("x"))
    assert fake_feishu.shown(CHAT) == []


async def test_a_lost_response_then_a_retry_with_the_same_uuid_shows_the_message_once(fake_feishu):
    client = sdk(fake_feishu)
    fake_feishu.fail("message.create", status=500, code=1500, msg="internal error", apply_first=True)
    lost = await client.im.v1.message.acreate(text_message("exactly once", uuid="u-lost"))
    assert lost.code == 1500
    retried = await client.im.v1.message.acreate(text_message("exactly once", uuid="u-lost"))
    assert retried.code == 0
    assert fake_feishu.texts(CHAT) == ["exactly once"]


async def test_faults_by_nth_call_and_predicate(fake_feishu):
    client = sdk(fake_feishu)
    fake_feishu.fail("message.create", nth=2, status=500, code=1500)
    fake_feishu.fail(None, method="POST", when=lambda call: "boom" in json.dumps(call.body), status=400, code=230001,
              msg="invalid")
    codes = [(await client.im.v1.message.acreate(text_message(t))).code for t in ("a", "b", "c", "boom")]
    assert codes == [0, 1500, 0, 230001]
    assert fake_feishu.texts(CHAT) == ["a", "c"]


async def test_enforced_limits_answer_past_feishus_published_pace(fake_feishu):
    client = sdk(fake_feishu)
    fake_feishu.clock = lambda: 1000.0  # every call within one window, however slow the machine
    fake_feishu.enforce_limits(app_sends=6, chat_sends=3)
    for chat in ("oc_a", "oc_b"):
        fake_feishu.chat(chat)
    codes = [(await client.im.v1.message.acreate(text_message(f"m{i}", chat="oc_a"))).code for i in range(4)]
    assert codes == [0, 0, 0, 230020]  # the fourth to one chat within a second
    codes = [(await client.im.v1.message.acreate(text_message(f"n{i}", chat="oc_b"))).code for i in range(4)]
    assert codes == [0, 0, 0, 99991400]  # the seventh the app sent within a second
    limited = fake_feishu.calls_to("message.create")[-1]
    assert (limited.status, fake_feishu.texts("oc_b")) == (429, ["n0", "n1", "n2"])
