/** The panel's icon: ranks above the supervisor that owns them (themed like JupyterLab's). */

import { LabIcon } from '@jupyterlab/ui-components';

const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <circle cx="5" cy="5.5" r="2.5"/><circle cx="12" cy="5.5" r="2.5"/><circle cx="19" cy="5.5" r="2.5"/>
    <path d="M4.25 8h1.5v6h-1.5zM11.25 8h1.5v6h-1.5zM18.25 8h1.5v6h-1.5z"/>
    <rect x="2.5" y="14" width="19" height="6.5" rx="1.5"/>
  </g>
</svg>`;

export const elasticIcon = new LabIcon({ name: 'elastic-nb:jobs', svgstr });
