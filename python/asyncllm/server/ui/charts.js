// A small line chart on a plain canvas: a few series over the last `points` polls.
import { el } from "./api.js";

const COLORS = ["#2f6fd1", "#d1622f", "#2fa36b", "#8a4fd1"];

export class LineChart {
  constructor(parent, id, title, names, format, points = 120) {
    this.names = names;
    this.format = format;
    this.points = points;
    this.series = names.map(() => []);
    this.root = el("div", "chart");
    this.root.id = id;
    this.canvas = el("canvas");
    this.legend = el("div", "legend");
    this.values = names.map((name, i) => {
      const item = el("span", "item");
      const value = el("span", "value", "–");
      value.dataset.series = name;
      item.append(el("span", `swatch c${i}`), el("span", "", name + " "), value);
      this.legend.append(item);
      return value;
    });
    this.root.append(el("h3", "", title), this.canvas, this.legend);
    parent.append(this.root);
  }

  // One poll's values (null: no value this time), then redraw.
  push(values) {
    this.root.dataset.samples = String(Number(this.root.dataset.samples || 0) + 1);
    values.forEach((value, i) => {
      const line = this.series[i];
      line.push(value);
      if (line.length > this.points) line.shift();
      this.values[i].textContent = value === null ? "–" : this.format(value);
      this.values[i].dataset.value = value === null ? "" : String(value);
    });
    this.draw();
  }

  draw() {
    const ratio = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth;
    const height = this.canvas.clientHeight;
    this.canvas.width = Math.round(width * ratio);
    this.canvas.height = Math.round(height * ratio);
    const ctx = this.canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    const all = this.series.flat().filter((v) => v !== null);
    const top = Math.max(...all, 0) * 1.1 || 1;
    const left = 48;
    const plotW = width - left - 4;
    const plotH = height - 16;
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#6b6b70";
    ctx.strokeStyle = "#e4e4e8";
    for (const frac of [0, 0.5, 1]) {
      const y = 4 + plotH * (1 - frac);
      ctx.beginPath();
      ctx.moveTo(left, y);
      ctx.lineTo(width - 4, y);
      ctx.stroke();
      ctx.fillText(this.format(top * frac), 2, y + 4);
    }
    const step = plotW / Math.max(this.points - 1, 1);
    this.series.forEach((line, i) => {
      ctx.strokeStyle = COLORS[i % COLORS.length];
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let drawing = false;
      const offset = this.points - line.length;
      line.forEach((value, j) => {
        if (value === null) {
          drawing = false;
          return;
        }
        const x = left + (offset + j) * step;
        const y = 4 + plotH * (1 - value / top);
        if (drawing) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        drawing = true;
      });
      ctx.stroke();
    });
  }
}
