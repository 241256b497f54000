"""One turn of the chat, as a part of ChatPanel: the answer streamed over the API and, with MCP tools on, the loop
(app/chat/tools.py): the answer ends with tool calls -> each waits for approval in the approval bar, runs, its
result is appended as a ``tool`` message -> the model is asked again, until it answers without a call, the turn's
cap is reached or Stop ends it. The whole turn is one task, so Stop cancels whatever it waits on (the stream, the
approval, a tool call)."""
from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import aclosing

import httpx

from app.chat import context, versions
from app.chat.images import content_tokens, text_of
from app.chat.store import Message
from app.chat.tools import Offer, agent_sampling, answer_calls
from app.client import ApiError


class TurnMixin:
    """Expects ChatPanel's controller, store, conversation, messages, streaming, options, context_bar, tools,
    tools_bar, approval, render(), _update_buttons(), update_context(), api_messages() and generation_finished."""

    def _new_answer(self) -> Message:
        assistant = self.store.append(self.conversation.id, Message("assistant", model=self.controller.model_id or ""))
        self.messages.append(assistant)
        self.streaming = assistant
        return assistant

    def _appender(self):
        """Appends a message to the conversation of the turn now starting (still that one's when the user has
        opened another meanwhile: Stop's answers to the calls left land where the calls are)."""
        conv = self.conversation

        def append(m: Message) -> None:
            try:
                self.store.append(conv.id, m)
            except sqlite3.IntegrityError:  # the conversation was deleted meanwhile
                return
            if self.conversation is conv:
                self.messages.append(m)
                self.dirty = True
        return append

    def request_params(self, offer: Offer, first: bool = False) -> dict:
        """The request's sampling and tools: with tools, Agent mode's sampling under this chat's own values (and,
        with Call a tool first, the turn's first request must call one)."""
        own = dict(self.options.options())
        if not offer.tools:
            return own
        forced = {"tool_choice": "required", "parallel_tool_calls": False} \
            if first and self.tools_bar.require.isChecked() else {}
        return {**agent_sampling(ninfer=self.controller.mode is not None), **own, "tools": offer.openai_tools(),
                **forced}

    async def _turn(self, msg: Message, before: list) -> None:
        try:
            chosen = self.tools_bar.chosen()  # the servers ticked under Tools (kept with the conversation)
            offer = await self.tools.offer(chosen) if chosen else Offer()
            if offer.problems:
                msg.stats["tool_notice"] = " ".join(offer.problems)
            calls, first, append = 0, True, self._appender()
            while True:
                await self._stream(msg, before, offer, first)
                before, first = [], False
                if not (offer.tools and msg.tool_calls) or msg.stats.get("error") or \
                        msg.stats.get("finish") in ("stopped", "length"):
                    return
                self.streaming = None
                self.render()
                calls = await answer_calls(self.tools, offer, msg.tool_calls, calls, self.approval.ask, append)
                self.render()
                if calls is None:
                    return
                msg = self._new_answer()
                self.render()
        finally:
            if self.streaming is not None:  # stopped before its stream began
                self.streaming.stats["finish"] = "stopped"
                self.store.update(self.streaming)
            self.streaming = None
            if self.task is asyncio.current_task():  # the turn is over: Send works from now, not from the task's
                self.task = None                     # done callback a moment later (a click between is lost)
            self.render()
            self._update_buttons()
            self.update_context()
            self.generation_finished.emit()

    async def _stream(self, msg: Message, before: list, offer: Offer, first: bool = False) -> None:
        client = self.controller.client
        fitted = context.fit(self.api_messages(), self.context_bar.window, self.max_tokens, self.chars_per_token)
        messages = fitted.messages
        if fitted.left_out:
            msg.stats["left_out"] = fitted.left_out
        params = self.request_params(offer, first)
        t0 = time.perf_counter()
        first: float | None = None
        events = 0
        usage = None
        finish = None
        try:
            stream = client.stream_chat(self.controller.model_id, messages, **params)
            async with aclosing(stream) as events_in:
                async for ev in events_in:
                    if ev.kind in ("content", "reasoning", "tool_calls"):
                        first = first if first is not None else time.perf_counter()
                        events += 1
                    if ev.kind == "content":
                        msg.content += ev.text
                    elif ev.kind == "reasoning":
                        msg.reasoning += ev.text
                    elif ev.kind == "tool_calls":
                        msg.tool_calls = ev.data
                    elif ev.kind == "usage":
                        usage = ev.data
                    elif ev.kind == "finish":
                        finish = ev.text
                    elif ev.kind == "error":
                        msg.stats["error"] = ev.text
                    self.dirty = True
        except asyncio.CancelledError:
            finish = "stopped"
            raise
        except ApiError as e:
            msg.stats["error"] = str(e)
        except httpx.HTTPError as e:
            msg.stats["error"] = f"{type(e).__name__}: {e or 'the connection failed'}"
        finally:
            self._finish_answer(msg, messages, before, usage, finish, t0, first, events)

    def _finish_answer(self, msg: Message, messages: list, before: list, usage, finish, t0, first, events) -> None:
        end = time.perf_counter()
        tokens = (usage or {}).get("completion_tokens", events if events else None)
        prompt_tokens = (usage or {}).get("prompt_tokens")
        if prompt_tokens:
            msg.stats["prompt_tokens"] = prompt_tokens
            chars = sum(len(text_of(m.get("content"))) for m in messages)
            text_tokens = prompt_tokens - sum(content_tokens(m.get("content")) for m in messages)  # (images: estimated)
            self.chars_per_token = context.calibrate(chars, text_tokens, self.chars_per_token, self.last_count)
            self.last_count = (chars, text_tokens)
        msg.stats.update(tokens=tokens, finish=finish or msg.stats.get("finish"),
                         ttft=(first - t0) if first is not None else None,
                         tok_s=((tokens - 1) / (end - first)) if first is not None and tokens and tokens > 1
                         and end > first else None)
        versions.finish(msg, before)
        self.store.update(msg)
        if self.streaming is msg:
            self.streaming = None
        self.render()
