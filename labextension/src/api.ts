/**
 * The client of the server extension's REST API (`{base_url}elastic-nb/api/`).
 *
 * Every call goes to the Jupyter server, which reaches the job's supervisor directly: none of
 * them waits on the job's kernel, so they work while a blocking `%%elastic` cell keeps it busy.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** An alert a job raised (failure, restart, hang, OOM, zombie, desync, stacks). */
export interface IAlert {
  kind: string;
  rank: number | null;
  text: string;
}

/** One job, session or session cell of a live supervisor of this user. */
export interface IJob {
  id: string;
  kind: 'job' | 'session' | 'cell';
  session: string | null;
  supervisor_pid: number;
  kernel_id: string | null;
  notebook: string | null;
  state: string;
  running: boolean;
  world_size: number;
  attempt: number;
  restarts: number;
  max_restarts: number;
  created: number;
  elapsed_s: number;
  alerts: IAlert[];
  outcome: string | null;
  summary: string | null;
  /** Its ranks waiting at a prompt (pdb's, an input()) now. */
  paused: number[];
}

/** A machine of a notebook's jobs: the notebook's own, or a join agent's (`%elastic nodes`). */
export interface INode {
  node: number;
  name: string;
  addr: string;
  cpus: number;
  gpus: string[];
  python: string;
  torch: string | null;
  cuda: string | null;
  state: string;
  why?: string | null;
  last_heard_s?: number;
  groups?: string[];
}

/** The machines of one notebook open to other machines (its supervisor's join agents). */
export interface IMachines {
  supervisor_pid: number;
  kernel_id: string | null;
  notebook: string | null;
  listening: { host: string; port: number; token: string };
  here: INode;
  agents: INode[];
}

/** One rank's stack, as the dashboard shows them side by side. */
export interface IRankStack {
  rank: number;
  pid: number | null;
  text: string;
}

export interface IStacks {
  ranks: IRankStack[];
  text: string;
}

/** A rank's stdout ("out") or stderr ("err"), each a file of the run directory. */
export type Stream = 'out' | 'err';

export interface ILogChunk {
  rank: number;
  attempt: number;
  stream: Stream;
  path: string;
  text: string;
  offset: number;
  size: number;
}

/** An update of a job: what the dashboard receives (state, rank chips, alerts, log lines). */
export interface IJobEvent {
  seq: number;
  t: number;
  kind: string;
  state?: string;
  attempt?: number;
  ranks?: { [rank: string]: { state: string; label?: string; pid?: number | null } };
  alerts?: { kind: string; title?: string; rank?: number | null; text?: string | null }[];
  logs?: { rank: number; stream: string; lines: string[] }[];
}

export interface IEvents {
  events: IJobEvent[];
  seq: number;
}

/** A failed call: the server's status (404 unknown job, 409 not running, ...) and reason. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
  }
}

async function call<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'elastic-nb/api', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ApiError(0, `the Jupyter server did not answer: ${error}`);
  }
  const text = await response.text();
  let body: any = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!response.ok) {
    const reason = body?.message || body?.reason || response.statusText;
    throw new ApiError(response.status, `${response.status}: ${reason}`);
  }
  return body as T;
}

const job = (id: string, what: string) => `jobs/${encodeURIComponent(id)}/${what}`;

/** Every job, and the machines of every notebook open to other machines. */
export function listJobs(): Promise<{ jobs: IJob[]; machines: IMachines[] }> {
  return call<{ jobs: IJob[]; machines?: IMachines[] }>('jobs').then(r => ({
    jobs: r.jobs,
    machines: r.machines ?? []
  }));
}

/** Stops a job, takes a session down, or interrupts a session cell. */
export function stopJob(id: string): Promise<{ stopping: string[] }> {
  return call(job(id, 'stop'), { method: 'POST', body: '{}' });
}

export function dumpStacks(id: string): Promise<IStacks> {
  return call(job(id, 'stacks'), { method: 'POST', body: '{}' });
}

/** A rank's log (its latest attempt's): from `offset` on, or without one its last `tail` lines. */
export function readLog(
  id: string,
  rank: number,
  stream: Stream,
  from: { offset: number } | { tail: number }
): Promise<ILogChunk> {
  const query = 'offset' in from ? `offset=${from.offset}` : `tail=${from.tail}`;
  return call(`${job(id, 'logs')}?rank=${rank}&stream=${stream}&${query}`);
}

export function jobEvents(id: string, since: number): Promise<IEvents> {
  return call(`${job(id, 'events')}?since=${since}`);
}
