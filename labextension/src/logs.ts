/**
 * A read-only tab that follows one rank's log live: its last lines first, then every new byte,
 * read from the server by offset (the run directory's files are the truth, as for the
 * dashboard). stdout by default; the tab's toolbar switches to stderr. A restart's new attempt
 * is followed from its start.
 */

import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { IJob, ILogChunk, Stream, readLog } from './api';
import { plain } from './format';

export const LOG_POLL_MS = 500;
const FIRST_LINES = 500;
/** What the tab holds: the newest characters that fit, in whole chunks (a browser slows past). */
const MAX_CHARS = 1_000_000;
/** Reads per poll while the log is behind (each read is capped by the server). */
const CATCH_UP_READS = 8;

export class LogView extends Widget {
  private _where: HTMLElement;
  private _pre: HTMLPreElement;
  private _chars = 0;
  private _stream: Stream = 'out';
  private _offset: number | null = null;
  private _attempt: number | null = null;
  private _poll: Poll;

  constructor(
    private readonly _job: IJob,
    private readonly _rank: number
  ) {
    super();
    this.addClass('enb-log-view');
    this.node.dataset.job = _job.id;
    this.node.dataset.rank = String(_rank);
    this._where = document.createElement('div');
    this._where.className = 'enb-log-where';
    this._pre = document.createElement('pre');
    this._pre.className = 'enb-log-text';
    this.node.append(this._where, this._pre);
    this._poll = new Poll({
      factory: () => this._read(),
      frequency: { interval: LOG_POLL_MS, backoff: true, max: 10 * LOG_POLL_MS },
      name: `elastic-nb:log:${_job.id}:${_rank}`,
      standby: () => !this.isVisible || 'when-hidden'
    });
  }

  /** A select for the tab's toolbar: which stream the tab follows. */
  streamPicker(): Widget {
    const item = new Widget();
    item.addClass('enb-log-stream');
    const select = document.createElement('select');
    select.title = 'Which stream of the rank the tab follows';
    select.append(new Option('stdout', 'out'), new Option('stderr', 'err'));
    select.addEventListener('change', () => {
      this._stream = select.value as Stream;
      this._offset = this._attempt = null;
      this._pre.replaceChildren();
      this._chars = 0;
      void this._poll.refresh();
    });
    item.node.append(select);
    return item;
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }

  private async _read(): Promise<void> {
    const stream = this._stream;
    for (let i = 0; i < CATCH_UP_READS; i++) {
      const from = this._offset === null ? { tail: FIRST_LINES } : { offset: this._offset };
      let chunk: ILogChunk;
      try {
        chunk = await readLog(this._job.id, this._rank, stream, from);
      } catch (error) {
        this._where.textContent = `Cannot read the log: ${error instanceof Error ? error.message : error}`;
        throw error;
      }
      if (stream !== this._stream) {
        return; // switched while the read was on its way
      }
      if (this._attempt !== null && chunk.attempt !== this._attempt) {
        // A restart: the new attempt's log, from its start.
        this._append(`\n── attempt ${chunk.attempt} ──\n`);
        this._attempt = chunk.attempt;
        this._offset = 0;
        continue;
      }
      this._attempt = chunk.attempt;
      this._offset = chunk.offset;
      this._where.textContent = `rank ${this._rank} · attempt ${chunk.attempt} · ${chunk.path}`;
      if (chunk.text) {
        this._append(plain(chunk.text));
      }
      if (chunk.offset >= chunk.size) {
        return;
      }
    }
  }

  private _append(text: string): void {
    const node = this.node;
    const atBottom = node.scrollTop + node.clientHeight >= node.scrollHeight - 4;
    this._pre.append(document.createTextNode(text));
    this._chars += text.length;
    while (this._chars > MAX_CHARS && this._pre.firstChild !== this._pre.lastChild) {
      const first = this._pre.firstChild!;
      this._chars -= first.textContent?.length ?? 0;
      first.remove();
    }
    if (atBottom) {
      node.scrollTop = node.scrollHeight;
    }
  }
}
